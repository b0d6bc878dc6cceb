"""Plans (GITOPS-3): facts gathered over SSH, diffed against the desired state into actions."""
