"""Load generator for OpenAI-compatible servers: ``python -m load_tests --help``.

Modules, in the order data flows: :mod:`load_tests.datasets` (what to send),
:mod:`load_tests.runner` (when to send it), :mod:`load_tests.client` (one timed streaming request),
:mod:`load_tests.stats` (percentiles, throughput, goodput) and :mod:`load_tests.report` (JSON + PNG);
:mod:`load_tests.cli` ties them together.
"""
