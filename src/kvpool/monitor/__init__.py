"""``kvpool monitor``: a live terminal view of any ``/metrics`` endpoint kvpool serves.

- :mod:`kvpool.monitor.scrape`: fetch and parse one endpoint (a failure is a down scrape,
  never an exception);
- :mod:`kvpool.monitor.maths`: counter increases and histogram quantiles between two scrapes
  (the quantile interpolates inside a bucket as Prometheus' ``histogram_quantile`` does);
- :mod:`kvpool.monitor.report`: one endpoint's figures per tier from two scrapes;
- :mod:`kvpool.monitor.view`: those figures as rich tables;
- :mod:`kvpool.monitor.cli`: the command (endpoints from the config, live view, ``--once``).
"""
