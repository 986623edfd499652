"""Each rank under mpirun (`--launcher openmpi` / `mvapich`): mpirun's variables become the ones
torch.distributed and dsf read, then it is `dsf`.

    deepspeed --launcher openmpi --module dsframework.commands.mpi_rank worker-0:29500 train RUN.yaml ...
    # on every rank: python -u -m dsframework.commands.mpi_rank worker-0:29500 train RUN.yaml ...

deepspeed's OpenMPI/MVAPICH runners start every rank with mpirun, which names ranks its own way;
`dsf train` without RANK would train a world of one.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

from dsframework.commands.cli import main as dsf_main
from dsframework.errors import UserError

MPI_RANK_VARS = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}


def mpi_rank_env(environ: Mapping[str, str], *, master: str) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT from mpirun's variables.

        mpi_rank_env({"OMPI_COMM_WORLD_RANK": "3", ...}, master="worker-0:29500")["RANK"]  # '3'
    """
    out = {}
    for name, sources in MPI_RANK_VARS.items():
        value = next((environ[source] for source in sources if source in environ), None)
        if value is None:
            raise UserError("mpirun", None, f"set none of {', '.join(sources)}",
                            "start this entry point through dsf launch --launcher openmpi or mvapich")
        out[name] = value
    addr, _, port = master.rpartition(":")
    per_node = max(int(out["LOCAL_WORLD_SIZE"]), 1)  # the node's index and count, as deepspeed's launcher sets
    cross = {"CROSS_RANK": str(int(out["RANK"]) // per_node), "CROSS_SIZE": str(int(out["WORLD_SIZE"]) // per_node)}
    return {**out, **cross, "LOCAL_SIZE": out["LOCAL_WORLD_SIZE"], "MASTER_ADDR": addr, "MASTER_PORT": port}


def main(argv: list[str] | None = None) -> None:
    """One rank under mpirun: `python -u -m dsframework.commands.mpi_rank MASTER:PORT train RUN.yaml ...`."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        os.environ.update(mpi_rank_env(os.environ, master=argv[0] if argv else ""))
    except UserError as err:
        print(f"dsf: error: {err}", file=sys.stderr)
        sys.exit(2)

    dsf_main(argv[1:])


if __name__ == "__main__":
    main()
