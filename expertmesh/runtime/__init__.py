"""Process plumbing shared by every role: TLS, telemetry, shutdown, limits, argparse types, health and reflection servers."""
