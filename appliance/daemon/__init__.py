"""applianced: the control plane (crews, state, the proxy child, the admin API). docs/daemon.md."""
