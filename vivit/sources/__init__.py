"""Sources of curvature: what the results layer asks of the GGN, answered one way each.

- :mod:`vivit.sources.collector`: the sink of every engine, per parameter group;
- :mod:`vivit.sources.data`: the caller's data, checked once, and every pass
  over it, part by part (chunks, batches, random state, progress);
- :mod:`vivit.sources.runs`: one part of the samples through an engine;
- :mod:`vivit.sources.union`: combining parts of the samples (scales, unions,
  merges, Monte-Carlo streams);
- :mod:`vivit.sources.stored`: stored factors of ``V`` (a batch, chunks, a loader,
  the ranks' shards);
- :mod:`vivit.sources.streamed`: factors recomputed in every pass over a loader.
"""
