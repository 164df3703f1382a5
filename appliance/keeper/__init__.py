"""The keeper's decision side in applianced: the gatekeeper model client (docs/keeper.md)."""
