"""Measurement code, beside the product and never imported by it (`runtime/` does not import this
package): the scripts that produce the published figures. Run from the repository root, e.g.
`python -m benchmarks.kernels.mla_decode`. The serving benchmarks (`loadgen`) have their own package."""
