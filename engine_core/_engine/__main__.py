"""``python -m engine_core._engine``: the engine-core process (see ``main``)."""

from engine_core._engine.main import main

main()
