"""Users kept in PostgreSQL (``settings.users.source: postgres``): the schema, loading, import, change notifications."""

from reconciler.userdb.database import CHANNEL, SCHEMA_VERSION, Loaded, UserDatabase, describe, dsn_of

__all__ = ["CHANNEL", "SCHEMA_VERSION", "Loaded", "UserDatabase", "describe", "dsn_of"]
