"""The workers' contract as their callers see it: wire types and errors, gRPC clients, tensors and arrays on the wire, KV snapshots."""
