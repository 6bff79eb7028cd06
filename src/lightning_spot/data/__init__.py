"""The data a pipeline trains on: global batches that survive layout changes, each replica reading its share
(``sharded``, its random draws in ``draws``), and streams whose position resumes on any layout (``streams``)."""
