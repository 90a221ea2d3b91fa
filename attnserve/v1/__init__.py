"""Generated gRPC stubs of protos/attnserve/v1 (python protos/build.py); do not edit."""
