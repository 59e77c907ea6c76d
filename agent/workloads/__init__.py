"""What runs on the node: Docker, inference workers behind their slot gates, jobs and rentals, their
status directories."""
