"""End-to-end client behaviour against real servers: round trips, flow control, connection pools, failures,
faults, garbage from the wire, split roles, pair-list bodies."""
