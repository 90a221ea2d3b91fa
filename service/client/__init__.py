"""The client side: the Python gRPC clients, `attnserve generate`, and `attnserve health`.

    from service.client import Client
    with Client("localhost:50051") as c:
        print(c.generate("ROMEO:", max_new_tokens=40).completions[0].text)
"""

from service.client.grpc_client import (
    AsyncClient,
    Client,
    add_connection_flags,
    build_request,
    channel_credentials,
    connection_options,
)

__all__ = ["AsyncClient", "Client", "add_connection_flags", "build_request", "channel_credentials",
           "connection_options"]
