"""Pods: which pod holds an allocation (PodResources), its annotations, the API and node labels."""
