//! Pure address-pool arithmetic and allocation decisions.
