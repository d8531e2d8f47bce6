"""The serving cluster checked as a cluster: several Ray nodes built on this machine
(cluster/ray_utils.py LocalCluster), joined and driven over HTTP as a ``ray up`` user would.
Named multinode, not cluster, so it is not read as pagedserve.cluster.

    cluster_check.py   python -m pagedserve.loadtest.multinode.cluster_check: placement,
                       node loss, scale-down, updates
    load.py            the steady HTTP load its phases run under (every result kept)
"""
