//! `--backend nccl`: the sweep's buffers in GPU memory (this rank's device, as
//! `ddp_comm::cuda::CudaGroup` picks it), each collective run by NCCL and timed until it has
//! finished on the device; inputs are made on the host and uploaded, results downloaded for
//! the correctness count.

use super::{count_wrong, setup, Bufs, Op, Target};
use cudarc::driver::CudaSlice;
use ddp_comm::cuda::{CudaGroup, CudaOptions, DeviceBackend};
use ddp_comm::{Error, ProcessGroup, ReduceOp};

/// Device buffers and the NCCL group.
pub struct Device {
    pg: ProcessGroup,
    group: CudaGroup,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    /// Host lengths of `a` and `b` (a zero-length `CudaSlice` cannot be copied).
    lens: (usize, usize),
}

fn dev_err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Device {
        call: call.into(),
        rank: 0,
        message: e.to_string(),
    }
}

impl Device {
    /// The NCCL group of `pg` (fails, naming why, when NCCL cannot be used).
    pub fn new(pg: ProcessGroup) -> ddp_comm::Result<Device> {
        let group = CudaGroup::new(
            &pg,
            CudaOptions {
                backend: Some(DeviceBackend::Nccl),
                ..Default::default()
            },
        )?;
        let s = group.compute_stream().clone();
        let a = s.alloc_zeros::<f32>(0).map_err(dev_err("cuMemAlloc"))?;
        let b = s.alloc_zeros::<f32>(0).map_err(dev_err("cuMemAlloc"))?;
        Ok(Device {
            pg,
            group,
            a,
            b,
            lens: (0, 0),
        })
    }

    fn upload(&self, v: &[f32]) -> ddp_comm::Result<CudaSlice<f32>> {
        let s = self.group.compute_stream();
        if v.is_empty() {
            return s.alloc_zeros::<f32>(0).map_err(dev_err("cuMemAlloc"));
        }
        s.clone_htod(v).map_err(dev_err("cuMemcpyHtoD"))
    }

    fn download(&self, d: &CudaSlice<f32>, n: usize) -> ddp_comm::Result<Vec<f32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let s = self.group.compute_stream();
        s.clone_dtoh(d).map_err(dev_err("cuMemcpyDtoH"))
    }
}

impl Target for Device {
    fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    fn prepare(&mut self, op: Op, elems: usize) -> ddp_comm::Result<()> {
        let Bufs { a, b } = setup(op, &self.pg, elems);
        self.lens = (a.len(), b.len());
        self.a = self.upload(&a)?;
        self.b = self.upload(&b)?;
        Ok(())
    }

    fn run_once(&mut self, op: Op) -> ddp_comm::Result<()> {
        let g = &self.group;
        match op {
            Op::AllReduce => g.all_reduce(&mut self.a, ReduceOp::Sum),
            Op::Broadcast => g.broadcast(&mut self.a, 0),
            Op::AllGather => g.all_gather(&self.a, &mut self.b),
            Op::ReduceScatter => g.reduce_scatter(&self.a, &mut self.b, ReduceOp::Sum),
        }
    }

    fn count_wrong(&mut self, op: Op) -> ddp_comm::Result<usize> {
        let bufs = Bufs {
            a: self.download(&self.a, self.lens.0)?,
            b: self.download(&self.b, self.lens.1)?,
        };
        Ok(count_wrong(op, &self.pg, &bufs))
    }
}
