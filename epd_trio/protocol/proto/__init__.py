"""Protocol v1's gRPC service ``epd_trio.v1.Encoder``: ``encoder.proto`` and its generated code.

The generated modules are checked in (``tools/gen_proto.py`` writes them) so that
users need no protoc; a test regenerates them and compares.
"""
