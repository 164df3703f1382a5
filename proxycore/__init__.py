"""The data plane: the sidecar proxy core (sans-IO protocol code plus one trio adapter per connection)."""
