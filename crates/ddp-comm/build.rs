//! With the `mpi` feature: compile `src/backend/mpi/shim.c` against the system MPI (found the
//! way the `mpi` crate finds it: `mpicc`, else pkg-config). Without it: nothing.

fn main() {
    println!("cargo:rerun-if-changed=src/backend/mpi/shim.c");
    #[cfg(feature = "mpi")]
    {
        let lib = build_probe_mpi::probe().unwrap_or_else(|errs| {
            panic!("feature `mpi`: no MPI library found (install e.g. libopenmpi-dev): {errs:?}")
        });
        let mut cc = cc::Build::new();
        cc.file("src/backend/mpi/shim.c");
        match lib.mpicc {
            Some(mpicc) => {
                cc.compiler(mpicc);
            }
            None => {
                for inc in &lib.include_paths {
                    cc.include(inc);
                }
            }
        }
        cc.compile("ddp_mpi_shim");
    }
}
