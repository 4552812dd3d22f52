"""Sources of curvature: what the results layer asks of the GGN, answered one way each.

- :mod:`vivit.sources.collector`: the sink of every engine, per parameter group;
- :mod:`vivit.sources.batches`: one block of samples through an engine (data
  checks, random state, progress);
- :mod:`vivit.sources.chunks`: a mini-batch in chunks of samples;
- :mod:`vivit.sources.blocks`: combining blocks of samples (scales, unions,
  merges, Monte-Carlo streams);
- :mod:`vivit.sources.stored`: stored factors of ``V`` (a batch, chunks, a loader,
  the ranks' shards);
- :mod:`vivit.sources.streamed`: factors recomputed in every pass over a loader.
"""
