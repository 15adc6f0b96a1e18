"""How each version is doing: traffic samples, the prediction log's format and retention,
ground truth and online quality, drift, SLOs and alerts."""
