//! Tests of the sampling module against independent expectations.

mod finish;
mod params;
mod sampler;
mod stop;
