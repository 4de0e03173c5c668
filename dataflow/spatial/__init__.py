"""Spatial decomposition: each sample's spatial dimensions split over the workers of a
sample group, convolutions exchanging halos (Dryden et al. 2019; LBANN's Distconv,
DistDL). ``partition(module, layout, group)`` turns a plain CNN into its partitioned
form; :mod:`~dataflow.spatial.geometry` says who owns which rows (pure)."""

from dataflow.spatial.geometry import Window, grid_shape, split_extent

__all__ = ["Window", "grid_shape", "split_extent"]
