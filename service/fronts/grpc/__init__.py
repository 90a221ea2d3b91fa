"""The gRPC front (attnserve.v1.TextGeneration, health, reflection)."""
