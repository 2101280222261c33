/* What the `mpi` crate's bindings do not export: MPI_IN_PLACE is a macro whose value differs
 * between MPI libraries ((void *) 1 in Open MPI, (void *) -1 in MPICH), so it is read here, from
 * the headers of the library the job links against. */
#include <mpi.h>

void *ddp_mpi_in_place(void) { return MPI_IN_PLACE; }
