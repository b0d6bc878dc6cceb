"""Where decisions go (publish): subscription files for every user, and the live answers' cache.

Both outlets call the same pure ``render`` on the same snapshot, so a file and
a live response for one user agree byte for byte (and so do their ETags).

Files: ``<subscriptions_dir>/<token>/{links.txt, sing-box.json, clash.yaml, headers.json}``
(folders 0700, files 0600: they hold credentials; give the web server that publishes them the
owner or a group by the service's own means)
— a static host or object store serves ``/sub/<token>/…`` without knowing us;
``headers.json`` carries the headers clients read (for an uploader that sets
them). Each file is written to a temporary name and renamed over the old one,
so a reader (or a crash) never sees a part. Only users whose document inputs
changed are rendered again: a fingerprint per user (the user, their entries,
the inbounds and keys those entries name) is kept in the state folder, and a
digest of the whole snapshot's inputs skips even that when nothing changed.

The package's modules, one job each: ``files`` (the file outlet), ``userfiles`` (one user's folder), ``parallel``
(a big pass in worker processes), ``manifest`` (what was published), ``digests`` (what changed), ``tokens`` and
``live`` (the live answers' cache).
"""

from reconciler.publish.digests import cluster_digest, snapshot_digest, usage_step
from reconciler.publish.files import FileOutlet
from reconciler.publish.live import LiveAnswers
from reconciler.publish.manifest import MANIFEST, Published, PublishedTable
from reconciler.publish.tokens import TokenIndex, Tokens
from reconciler.publish.userfiles import WriteStats

__all__ = ["MANIFEST", "FileOutlet", "LiveAnswers", "Published", "PublishedTable", "TokenIndex", "Tokens", "WriteStats",
           "cluster_digest", "snapshot_digest", "usage_step"]
