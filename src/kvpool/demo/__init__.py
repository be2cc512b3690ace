"""``kvpool demo``: replay request workloads through a Hugging Face causal LM with prefix caching.

:mod:`kvpool.demo.workloads` builds the workloads (multi-turn chat, long-document QA and replays of
request traces) as token ids; :mod:`kvpool.demo.runner` replays them in every mode and
:mod:`kvpool.demo.report` compares time to first token.
"""
