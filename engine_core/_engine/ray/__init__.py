"""Engines on a Ray cluster: the launcher that places an engine-core process in a Ray actor
(``launch``, imported only when ``data_parallel_backend="ray"``) and the placement rules
(``placement``, pure)."""
