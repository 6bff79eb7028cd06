"""Small helpers every layer may use: collectives that work with one process too (``distributed``), sizes and
durations as people read them (``units``), and the Lightning warnings that do not apply to pipelines
(``warnings``)."""
