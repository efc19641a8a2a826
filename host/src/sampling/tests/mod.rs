//! Tests of the sampling module against independent expectations.

mod params;
mod sampler;
mod stop;
mod token_filters;
