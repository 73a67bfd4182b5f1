/** Service status: identity, protocol, default model, inference worker (GET /service). */

import * as React from 'react';

import type { SidebarModel } from '../model';
import { Section, StateBadge } from './common';

export function ServiceView(props: { model: SidebarModel }): React.ReactElement {
  const { data: service, error, loaded } = props.model.service;
  return (
    <Section title="Service" name="service" error={error}>
      {service ? (
        <dl className="jp-LMSP-facts">
          <dt>name</dt>
          <dd data-field="name">
            {service.name} {service.version}
          </dd>
          <dt>id</dt>
          <dd data-field="id" title={service.id}>
            {service.id}
          </dd>
          <dt>protocol</dt>
          <dd data-field="protocol">{service.protocol}</dd>
          <dt>default model</dt>
          <dd data-field="default_model">{service.default_model ?? '(none)'}</dd>
          <dt>worker</dt>
          <dd data-field="worker">
            <StateBadge state={service.worker.state} />
            {service.worker.blas ? ` ${service.worker.blas}` : ''}
            {/* The owner's alone: a paired client is not told (LMSP: the worker's pid). */}
            {service.worker.pid != null ? ` pid ${service.worker.pid}` : ''}
          </dd>
        </dl>
      ) : loaded ? null : (
        <div className="jp-LMSP-empty">Connecting…</div>
      )}
    </Section>
  );
}
