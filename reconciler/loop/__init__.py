"""The long-running loop: collection, learned state, outlets (files, HTTP), timers (GITOPS-5, HEALTH-1..13)."""
