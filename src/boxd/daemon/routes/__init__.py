"""The HTTP API: each module is one group of routes; they only call the daemon's services."""
