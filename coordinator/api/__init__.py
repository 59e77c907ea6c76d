"""The gRPC surfaces: admin, public, the agent link, and their conversions and errors."""
