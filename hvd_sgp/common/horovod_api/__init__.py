"""Horovod's API on the core, kept apart from the SGP algorithm (which never goes through it):
negotiated collectives on numpy arrays, process sets, join, the stall check and Horovod's
Compressor interface (numpy + mpi4py; importing starts no MPI).

negotiation   the agreement round before every collective, deadlines, the progress loop
process_sets  ProcessSet, registration, one communicator and controller per set
collectives   the kinds (allreduce, allgather, broadcast, alltoall, reducescatter, barrier)
join          join() as an event loop, and the participant hook for the optimizer
basics        Horovod's flat namespace shared by the torch and tensorflow adapters
compression   Horovod's Compression namespace, generated from the codec registry
elastic       Horovod's elastic API: State, run(), commits, the reset after a repair or a
              change of hosts
"""
