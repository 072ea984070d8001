#!/bin/bash
#SBATCH --job-name=wan14b-720p
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
# One task per GPU; Lightning's SLURMEnvironment reads ranks and the master address from SLURM.
set -euo pipefail
srun python -m lightning_adaptiveload.train experiment=wan2_1_14b_720p \
    trainer.num_nodes="$SLURM_NNODES" trainer.devices=8 "$@"
