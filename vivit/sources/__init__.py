"""Sources of curvature: what the results layer asks of the GGN, each its way."""
