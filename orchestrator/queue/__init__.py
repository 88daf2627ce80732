"""A persistent job queue and the driver that admits its jobs to a Ray cluster.

store      the SQLite file: schema, transactions, rows, events (validates and estimates nothing)
admission  Demand, place()/reserve(): does a job fit the cluster (a backends.base.ClusterView) now, ever,
           and why not;
           fit_node_type(): could it fit a KubeRay node type at all (Kueue admits by quota)
driver     the Driver (reconcile / poll / admit / submit / retry / out-of-memory retry), enqueue()
"""
