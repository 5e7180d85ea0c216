"""The small actor runtime every service shares: bus, logging, service base, subjects."""
