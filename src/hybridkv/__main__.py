"""``python -m hybridkv``: the ``hybridkv`` command (for an environment whose ``bin`` is not on ``PATH``)."""

from hybridkv.cli import main

raise SystemExit(main())
