"""``python -m kvactors_lmcache.serving``: the serving validation (see ``procedure.main``)."""

from kvactors_lmcache.serving.procedure import main

raise SystemExit(main())
