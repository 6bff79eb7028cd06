"""The memory tier: each rank's state kept in host memory (tmpfs files that outlive the workers), copied to a
peer node, recovered onto any layout."""
