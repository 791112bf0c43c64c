"""``python -m kvactors_serving``: the serving validation (see ``procedure.main``)."""

from kvactors_serving.procedure import main

raise SystemExit(main())
