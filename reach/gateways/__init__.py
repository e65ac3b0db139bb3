"""Gateways from the standard agent protocols to the fabric: each serves what the
registry holds to clients of another protocol and turns their requests into fabric calls
(``ReachClient.call``, with its routing, retries, clearance and audit)."""
