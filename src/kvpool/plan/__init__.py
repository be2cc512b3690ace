"""``kvpool plan``: replay a whole request trace through kvpool's own policy objects, offline.

For every DRAM size x SSD size x eviction policy it reports hit rates, prefill tokens saved,
bytes read and written per tier, SSD write amplification, an estimated TTFT and a cost per
million prompt tokens, beside Belady's offline optimum at each DRAM size. No model and no
bytes are involved: only which chunk is where. Modules: ``trace`` (reading), ``dram`` and
``ssd`` (the tiers' bookkeeping over the policies of :mod:`kvpool.policy`), ``replay`` (the
pool's calls per request), ``belady``, ``cost`` (TTFT and money), ``report`` and ``plots``
(output), ``cli``. See docs/plan.md.
"""
