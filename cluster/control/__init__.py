"""The Ray control plane: a tensor-parallel group of worker actors in one placement
group, and the per-step plan broadcast to them (ZMQ PUSH/PULL by default, a Ray compiled
graph as the alternative).

Owns: actor placement, ray.init on loopback, dispatch and its failure handling. May import
ray, zmq, cluster.engine (the Executor interface), scheduler/ wire types and worker/
(inside the actors). Nothing in cluster.engine imports it at module load.
"""
