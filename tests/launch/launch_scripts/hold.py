"""A job that needs no torch (it starts in moments): each rank prints its RANK,
WORLD_SIZE and MASTER_PORT; with a FIFO path as argv[1], rank 0 then prints "HOLDING"
and stays until the test opens and closes that FIFO (a job kept alive on purpose).
"""
import os
import sys

rank = os.environ["RANK"]
print(f"RANK {rank} WORLD_SIZE {os.environ['WORLD_SIZE']} MASTER_PORT {os.environ['MASTER_PORT']} "
      f"JOB {os.environ.get('JOB_TAG', '')}", flush=True)
if len(sys.argv) > 1 and rank == "0":
    print("HOLDING", flush=True)
    with open(sys.argv[1]) as fifo:  # blocks until the test opens the FIFO for writing
        fifo.read()  # returns when the test closes it
print(f"rank {rank} done", flush=True)
