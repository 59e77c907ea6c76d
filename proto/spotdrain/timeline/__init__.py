"""The timeline's SVG rendering."""
