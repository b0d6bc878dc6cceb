"""Applying plans to servers: transactions, verification, rollback, locks (GITOPS-4, GITOPS-7)."""
