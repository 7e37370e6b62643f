"""Control plane: every wire message (protocol), ZeroMQ channels, the READY handshake, least-busy routing."""
