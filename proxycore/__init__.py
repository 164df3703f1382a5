"""The data plane: the sidecar proxy core.

Sans-IO protocol modules plus one trio adapter per connection (see docs/architecture.md).
"""
