"""Gateways from the standard agent protocols to the fabric: each speaks a protocol
(MCP, A2A) to its clients and makes fabric calls (``ReachClient``) under its own
credential. Their SDKs are the ``gateways`` extra: nothing here is imported by
``import reach``."""
