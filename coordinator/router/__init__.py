"""spotdrain-router, a separate program: routes requests to inference workers."""
